"""Process set-up, by concern: words (one-line messages), logs, machine (threads, memory, network),
devices (the training device), lifecycle (SIGTERM, deadlines, exit). RPC itself is app/exchange/transport.py."""
