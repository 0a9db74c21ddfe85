"""cluster: the serving side of specdec (operator config, routing; Ray wiring to come)."""
