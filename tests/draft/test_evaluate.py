"""The replay of the engine's drafting (draft/evaluate.replay_steps): a
step's proposals are tested until the first wrong one, and the next step
starts after the target's token that follows the last one kept."""

from draft.evaluate import replay_steps

T, F = True, False


def test_steps_test_proposals_until_the_first_wrong_one_and_move_past_what_they_kept():
    right = [[T, T, F, T, T, T, F, F, T, T],  # proposal 1 from each anchor
             [T, F, T, F, T, F, T, T, T, F]]  # proposal 2
    # anchor 0 keeps both (next anchor 3), 3 and 5 keep one (next 5, 7), 7 none (8)
    assert replay_steps(right, 0, 8) == (2 + 2 + 2 + 1, 2 + 1 + 1 + 0)
    assert replay_steps(right, 2, 8) == (1 + 2 + 2 + 1, 0 + 1 + 1 + 0)  # 2, 3, 5, 7
    assert replay_steps(right, 8, 8) == (0, 0)


def test_all_right_keeps_every_proposal_and_all_wrong_tests_one_a_step():
    k, n = 4, 20
    assert replay_steps([[T] * n] * k, 0, n - k) == (16, 16)  # anchors 0, 5, 10, 15
    assert replay_steps([[F] * n] * k, 0, n - k) == (16, 0)  # every anchor to 15
