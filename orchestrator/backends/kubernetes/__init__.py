"""The kubernetes target: manifests for `kubectl apply -f`; no verb talks to a cluster."""
