"""The local Kubernetes control plane for tests (see tests/cluster/README.md)."""
