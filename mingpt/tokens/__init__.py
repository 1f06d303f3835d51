"""The token data: the token file made once per machine and memory-mapped by every rank, a seeded
permutation that fixes one global sample order, and each rank's batches in that order."""
