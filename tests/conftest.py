import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # Tests are steadier without torch threads fighting other processes.
    torch.set_num_threads(1)
