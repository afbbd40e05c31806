"""What more than one op of the pack uses: each module names the ops it serves. Nothing here registers an op."""
