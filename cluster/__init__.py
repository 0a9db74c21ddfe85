"""cluster: the control plane of specdec: operator config, the ingress (Ray Serve, OpenAI API and gRPC),
routing, placement of the actors on a Ray cluster, supervision, and the operator's commands."""
