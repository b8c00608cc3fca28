"""The local Kubernetes control plane for tests (see README, "Local control plane for tests")."""
