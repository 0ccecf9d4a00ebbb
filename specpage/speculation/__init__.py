"""Speculative decoding: the draft proposes, the target verifies.

Vocabulary (as in docs/DESIGN.md):

- proposal: the k draft tokens of one sequence in one step, with the draft's
  probabilities for them when sampling.
- accepted / rejected: proposal tokens that verification keeps / drops.
- recovered: the token sampled from norm(max(0, p - q)) at the first rejection.
- bonus: the extra target token sampled when all k proposals are accepted.

Each step a sequence therefore gains accepted + 1 tokens. k = 0 is plain
decoding through the same path.
"""
