"""The node runtime: Ray actors (target ranks, draft replicas) and the target's gRPC service, thin shells
that own models and call specdec/. The layers run one way, cluster -> actors -> specdec: nothing here
imports cluster/ (tests/test_layers.py checks it); what the control plane needs of an actor comes to it
as arguments."""
