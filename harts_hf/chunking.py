"""The chunk grid of the linear-attention kernels: the one chunk size every floor agrees on.

transformers' torch fallbacks and fla's chunk kernels hold recurrent states every 64 tokens of a
trajectory; the tree ops run on the same grid (so a tree keeps every chunk boundary trajectory-wise
training has), the fla backend hands them to fla's kernels, and the planner prefers its cuts on it.
"""

CHUNK_SIZE = 64
