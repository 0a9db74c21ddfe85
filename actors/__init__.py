"""Ray actors: thin shells that own models and call specdec/ and cluster/."""
