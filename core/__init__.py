"""The shared core: what the packer, the trainer and the operator must agree on (errors and exit codes,
the pod-to-operator contract, config models, the family registry, media geometry, the pack format)."""
