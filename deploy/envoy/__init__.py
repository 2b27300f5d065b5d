"""Envoy in front of the gateway replicas: ``envoy_bootstrap(topology)`` builds the v3 bootstrap;
``python -m deploy.envoy`` writes it as ``envoy.yaml``."""

from deploy.envoy.config import envoy_bootstrap

__all__ = ["envoy_bootstrap"]
