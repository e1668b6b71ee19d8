# The project's own MLflow tracking server (`tracking.mlflow: true` in a topology):
# `mlflow server` with its sqlite store and artifacts on the volume at /mlflow.
# Built by orchestrator/tracking_image.py from a context of its own: this file,
# the lock requirements/tracking-server.txt (`make lock`), images/requirements.py
# and, offline, the wheels of images/wheelhouse-tracking/ (images/wheelhouse.sh
# with LOCK and OUT).
#
# FROM a Python with pip and no torch (a server imports none): the official Python
# image, or offline ps-compose-python:bookworm, the offline base's tree before its
# torch pair (images/build-offline-base.sh). pip installs the lock's packages that
# the base lacks, each checked against its hashes, as the app's image does
# (images/Dockerfile).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG PIP_SOURCE=index
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

USER root
# User psc (uid/gid 1000), never root at run time; /mlflow is the volume's mount
# point, owned by psc here so that a fresh volume is writable by it.
RUN set -eu; \
    old=$(getent passwd 1000 | cut -d: -f1 || true); \
    if [ -n "$old" ]; then userdel "$old"; fi; \
    oldg=$(getent group 1000 | cut -d: -f1 || true); \
    if [ -n "$oldg" ]; then groupdel "$oldg"; fi; \
    groupadd -g 1000 psc; \
    useradd -u 1000 -g 1000 -m -s /bin/sh psc; \
    mkdir -p /mlflow/artifacts; \
    chown -R psc:psc /mlflow

COPY build/ /tmp/build/
RUN set -eu; \
    python /tmp/build/requirements.py /tmp/build/tracking-server.txt --not-installed > /tmp/build/requirements.txt; \
    if [ "$PIP_SOURCE" = wheelhouse ]; then \
        PIP_BREAK_SYSTEM_PACKAGES=1 python -m pip install --no-index --find-links /tmp/build/wheels \
            --no-deps --require-hashes -r /tmp/build/requirements.txt; \
    else \
        PIP_BREAK_SYSTEM_PACKAGES=1 python -m pip install --no-deps --require-hashes -r /tmp/build/requirements.txt; \
    fi; \
    python /tmp/build/requirements.py /tmp/build/tracking-server.txt --differences; \
    rm -rf /tmp/build; \
    mlflow --version

USER psc
WORKDIR /mlflow
EXPOSE 5000
ENTRYPOINT ["mlflow", "server"]
