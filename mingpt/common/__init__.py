"""The ground every package stands on, importing nothing else of the project: errors said in one
line (and the shell of every command), the one logger (rank 0 speaks), and the one door to files,
local paths and fsspec URLs alike."""
