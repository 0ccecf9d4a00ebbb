"""Bounds on a request's stop strings and stop token ids: in the parameters,
the config, and over gRPC from a real daemon."""

import grpc
import pytest

from specpage.client import Client
from specpage.config import ConfigError, load_config
from specpage.core.engine_config import EngineConfig
from specpage.core.request import DEFAULT_STOP_LIMITS, SamplingParams, StopLimits, ValidationError
from tests.support.daemon import Daemon

TEN_THOUSAND = tuple(f"stop {i}" for i in range(10_000))


def field_error(params, limits=DEFAULT_STOP_LIMITS):
    with pytest.raises(ValidationError) as error:
        params.validate(limits)
    return error.value.field, str(error.value)


def test_ten_thousand_stop_strings_are_refused_naming_stop():
    assert field_error(SamplingParams(stop=TEN_THOUSAND)) == (
        "stop", "stop: at most 64 stop strings, got 10000")


def test_stop_strings_are_bounded_in_characters_in_all():
    SamplingParams(stop=("x" * 64,) * 64).validate()  # exactly at both bounds
    assert field_error(SamplingParams(stop=("x" * 64,) * 63 + ("x" * 65,))) == (
        "stop", "stop: at most 4096 characters in all, got 4097")


def test_stop_token_ids_are_bounded():
    SamplingParams(stop_token_ids=tuple(range(256))).validate()
    assert field_error(SamplingParams(stop_token_ids=tuple(range(257)))) == (
        "stop_token_ids", "stop_token_ids: at most 256 ids, got 257")


def test_limits_are_the_callers():
    limits = StopLimits(max_stop_strings=2, max_stop_chars=5, max_stop_token_ids=1)
    SamplingParams(stop=("ab", "cde"), stop_token_ids=(7,)).validate(limits)
    assert field_error(SamplingParams(stop=("a", "b", "c")), limits)[0] == "stop"
    assert field_error(SamplingParams(stop=("abc", "def")), limits)[0] == "stop"
    assert field_error(SamplingParams(stop_token_ids=(1, 2)), limits)[0] == "stop_token_ids"


def test_empty_stop_strings_and_negative_ids_are_still_refused():
    assert field_error(SamplingParams(stop=("a", ""))) == (
        "stop", "stop: stop strings must not be empty, got ('a', '')")
    assert field_error(SamplingParams(stop_token_ids=(3, -1))) == (
        "stop_token_ids", "stop_token_ids: must be >= 0, got (3, -1)")


def test_the_config_sets_the_limits():
    config = load_config(env={"SPECPAGE_ENGINE_MAX_STOP_STRINGS": "8"},
                         overrides={"engine.max_stop_token_ids": 3})
    assert config.engine.stop_limits == StopLimits(max_stop_strings=8, max_stop_chars=4096,
                                                   max_stop_token_ids=3)
    assert EngineConfig().stop_limits == StopLimits()
    with pytest.raises(ConfigError, match="engine.max_stop_chars must be > 0"):
        EngineConfig(max_stop_chars=0)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    process = Daemon(tmp_path_factory.mktemp("stop-limits"), engine="max_stop_token_ids = 8\n")
    process.wait_serving()
    yield process
    assert process.stop() == 0


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(stop=list(TEN_THOUSAND)), "stop: at most 64 stop strings, got 10000"),
        (dict(stop_token_ids=list(range(9))), "stop_token_ids: at most 8 ids, got 9"),
    ],
)
async def test_the_daemon_refuses_too_many_stop_conditions(daemon, options, message):
    async with Client(daemon.address, max_retries=0) as client:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.complete([5, 6, 7], max_tokens=4, **options)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == message
        # nothing else is disturbed
        done = await client.complete([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 4
