import os

import pytest
import torch

# Triton picks interpreter or compiler when it is first imported (transformers
# imports it through torch._dynamo), so the choice is made here, before any
# test module: the interpreter wherever there is no GPU.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # Tests are steadier without torch threads fighting other processes.
    torch.set_num_threads(1)
