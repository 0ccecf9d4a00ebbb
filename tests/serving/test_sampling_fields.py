"""The sampling fields on the gRPC front: each maps to its SamplingParams
field, absent ones keep the defaults, -1 in the client is no seed, and a
value out of range is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from specpage.client import Client, generate_request
from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.models.loader import load_model
from specpage.serve.grpc_server import sampling_params
from specpage.serve.grpc_stubs import generation_pb2 as pb
from tests.support.checkpoints import tiny_checkpoint
from tests.support.inprocess import serving_engine

PROMPT = [7, 8, 9, 10]
GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_every_field_maps_to_its_sampling_parameter():
    message = generate_request(
        PROMPT, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.25,
        min_p=0.125, min_tokens=3, logit_bias={5: 2.5, 17: -100.0}).sampling
    params = sampling_params(message)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_p, params.min_tokens) == (0.5, -0.25, 1.25, 0.125, 3)
    assert params.logit_bias == {5: 2.5, 17: -100.0}


def test_absent_fields_change_nothing():
    params = sampling_params(generate_request(PROMPT).sampling)
    assert params == SamplingParams()


def test_a_seed_of_minus_one_is_no_seed():
    assert not generate_request(PROMPT, seed=-1).sampling.HasField("seed")
    assert generate_request(PROMPT, seed=0).sampling.seed == 0
    assert SamplingParams(seed=-1).seed is None


OUT_OF_RANGE = {
    "presence_penalty": dict(presence_penalty=2.5),
    "frequency_penalty": dict(frequency_penalty=-3.0),
    "repetition_penalty": dict(repetition_penalty=0.0),
    "min_p": dict(min_p=1.5),
    "min_tokens": dict(min_tokens=5),  # above max_tokens
    "logit_bias": dict(logit_bias={5: 101.0}),
}


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    tiny_checkpoint(tmp_path)  # a vocabulary of 211
    return Engine(load_model(tmp_path), None, None, EngineConfig(
        block_size=4, num_blocks=64, max_num_seqs=4, adaptive_k=False, spec_methods=""))


async def refused(client: Client, **fields) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.complete(PROMPT, **GREEDY, **fields)
    return error.value


@pytest.mark.asyncio
async def test_out_of_range_values_are_invalid_argument_naming_the_field(engine):
    async with serving_engine(engine) as served, Client(served.address, max_retries=0) as client:
        for name, fields in OUT_OF_RANGE.items():
            error = await refused(client, **fields)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert error.details().startswith(f"{name}: "), error.details()
        error = await refused(client, logit_bias={211: 1.0})
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "logit_bias: token id 211 outside 0..210"
        completion = await client.complete(PROMPT, **GREEDY, presence_penalty=2.0,
                                           frequency_penalty=-2.0, min_p=1.0,
                                           logit_bias={210: 100.0}, min_tokens=4)
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4


def test_the_proto_numbers_new_fields_after_the_old():
    """Old clients and servers read the message as before."""
    numbers = {f.name: f.number for f in pb.SamplingParameters.DESCRIPTOR.fields}
    assert [numbers[name] for name in ("presence_penalty", "frequency_penalty",
                                       "repetition_penalty", "min_p", "min_tokens",
                                       "logit_bias")] == list(range(11, 17))
    assert numbers["logprobs"] == 10
