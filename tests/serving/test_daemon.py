"""The daemon over real gRPC on 127.0.0.1, tiny models made in the tests."""

import asyncio
import json
import random
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from specpage.client import Chunk, Client, Final
from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.models.loader import load_model
from tests.support.daemon import Daemon, tiny_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")
GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
RETRIES = 3000
DRAIN_GRACE_S = 600  # the drains here end when their requests do, long before this
HEALTH_TIMEOUT_S = 60.0  # for the daemon to answer NOT_SERVING after SIGTERM


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("daemon")
    process = Daemon(folder, server="max_queue = 64\nmax_prompt_tokens = 100\n"
                                    "max_message_bytes = 65536", gate=True)
    process.wait_serving()
    yield process
    assert process.stop() == 0


async def wait_idle(client, timeout=60.0):  # a bound on a hang, not on the speed
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        info = await client.server_info()
        if info.running == 0 and info.waiting == 0 and info.pool.in_use == 0:
            return info
        await asyncio.sleep(0.1)
    raise AssertionError(f"daemon not idle: {info}")


async def until_passed(moment):
    """Sleeps until time.monotonic() (one clock for every process) is past moment."""
    while (now := time.monotonic()) <= moment:
        await asyncio.sleep(moment - now)


def prompt(seed, length=9):
    rng = random.Random(seed)
    return [rng.randrange(1, 211) for _ in range(length)]


async def test_streamed_greedy_output_equals_the_offline_engine(daemon, tmp_path):
    target, draft = tiny_pair(daemon.config.parent / "models")
    offline = Engine(load_model(target), load_model(draft), None,
                     EngineConfig(block_size=4, num_blocks=512, spec_k=3))
    expected = {}
    for i in range(3):
        offline.add_request(str(i), prompt(i), SamplingParams(**GREEDY))
    while offline.has_unfinished():
        for out in offline.step():
            expected.setdefault(out.request_id, []).extend(out.token_ids)
    async with Client(daemon.address) as client:
        for i in range(3):
            chunks, final = [], None
            async for event in client.generate(prompt(i), request_id=f"eq{i}", **GREEDY):
                if isinstance(event, Chunk):
                    chunks.append(event)
                else:
                    final = event
            tokens = [t for c in chunks for t in c.token_ids]
            assert tokens == expected[str(i)]
            assert [c.num_tokens for c in chunks] == list(
                __import__("itertools").accumulate(len(c.token_ids) for c in chunks))
            assert final.finish_reason == "length"
            assert final.finish_reasons == ["length"]
            assert final.usage.completion_tokens == 12 and final.usage.prompt_tokens == 9
            assert final.usage.drafted_tokens >= final.usage.accepted_tokens
            assert final.timings.total_s >= final.timings.queue_s >= 0
        info = await wait_idle(client)
        assert info.block_size == 4 and info.draft_model


async def test_request_id_is_echoed_and_generated(daemon):
    async with Client(daemon.address) as client:
        call = client.stub.Generate(__import__("specpage.client").client.generate_request(
            prompt(1), max_tokens=2, temperature=0.0))
        metadata = dict(await call.initial_metadata())
        assert len(metadata["request-id"]) == 32
        async for _ in call:
            pass


async def test_cancel_and_deadline_free_the_blocks(daemon):
    """With the step gate closed no request can finish, so each deadline
    passes before its request could end, however fast the machine."""
    gate = daemon.gate
    async with Client(daemon.address) as client:
        long = dict(max_tokens=400, temperature=0.0, ignore_eos=True)
        events = client.generate(prompt(2, 40), request_id="cancel-me", **long)
        async for event in events:
            assert isinstance(event, Chunk)
            break
        await events.aclose()  # leaving the iterator cancels the call
        gate.close()
        try:
            # the call's own deadline: the client ends it while no step runs
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in client.generate(prompt(3, 40), deadline_s=0.3, **long):
                    pass
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            gate.open()
        await wait_idle(client)
        # the request's timeout: the engine drops it at its first step past
        # it, and no step runs until it has passed
        gate.close()
        try:
            admitted = gate.admitted()
            call = asyncio.ensure_future(client.complete(prompt(4, 40), timeout_s=0.3, **long))
            await gate.wait_admitted(admitted + 1)  # its deadline is set before admission
            await until_passed(time.monotonic() + 0.3)
        finally:
            gate.open()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_idle(client)


async def test_a_killed_client_process_frees_its_blocks(daemon):
    gate = daemon.gate
    script = textwrap.dedent(f"""
        import asyncio, sys
        from specpage.client import Client
        async def main():
            async with Client("{daemon.address}") as client:
                async for event in client.generate(list(range(1, 30)), max_tokens=400,
                                                   temperature=0.0, ignore_eos=True):
                    print("streaming", flush=True)
                    await asyncio.sleep(60)
        asyncio.run(main())
    """)
    gate.close()
    try:
        with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True) as child:
            await gate.wait_held()
            gate.allow()  # the prompt's prefill, which samples the first token
            assert child.stdout.readline().strip() == "streaming"
            async with Client(daemon.address) as client:
                assert (await client.server_info()).running == 1  # held after one step
                child.kill()
                child.wait()
                gate.open()
                await wait_idle(client)
    finally:
        gate.open()


async def test_64_concurrent_streams_with_cancels_and_deadlines(daemon):
    rng = random.Random(9)

    async def one(i, client):
        kind = rng.choice(["complete", "cancel", "deadline"])
        options = dict(max_tokens=rng.randint(4, 40), temperature=0.8, seed=i,
                       ignore_eos=True)
        if kind == "complete":
            completion = await client.complete(prompt(i, rng.randint(3, 30)), **options)
            assert completion.finish_reason == "length"
            assert len(completion.token_ids) == options["max_tokens"]
            return "ok"
        if kind == "deadline":
            options["max_tokens"] = 400
            try:
                await client.complete(prompt(i), deadline_s=rng.uniform(0.05, 0.5), **options)
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                return "deadline"
            return "ok"
        task = asyncio.ensure_future(client.complete(prompt(i), **options))
        await asyncio.sleep(rng.uniform(0, 0.3))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "ok"

    async with Client(daemon.address) as client:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(i, client) for i in range(64))), timeout=120)
        assert set(results) <= {"ok", "deadline", "cancelled"} and len(results) == 64
        await wait_idle(client)
    assert daemon.health() == 1  # SERVING


@pytest.mark.parametrize(
    ("options", "code", "message"),
    [
        (dict(temperature=-1.0), "INVALID_ARGUMENT", "temperature"),
        (dict(top_p=1.5), "INVALID_ARGUMENT", "top_p"),
        (dict(max_tokens=0), "INVALID_ARGUMENT", "max_tokens"),
        (dict(prompt=list(range(1, 150))), "INVALID_ARGUMENT", "exceed the limit of 100"),
        (dict(prompt=[]), "INVALID_ARGUMENT", "prompt: give text or token_ids"),
        (dict(prompt=[5, 999]), "INVALID_ARGUMENT", "token id 999"),
        (dict(prompt="text"), "INVALID_ARGUMENT", "tokenizer"),
        (dict(prompt=list(range(1, 200)) * 400), "RESOURCE_EXHAUSTED", "larger than max"),
        (dict(timeout_s=-1.0), "INVALID_ARGUMENT", "timeout_s"),
    ],
)
async def test_bad_input_gets_its_status_code(daemon, options, code, message):
    request_prompt = options.pop("prompt", prompt(5))
    async with Client(daemon.address, max_retries=0) as client:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.complete(request_prompt, **options)
        assert error.value.code().name == code
        assert message in error.value.details()
        # nothing else is disturbed
        assert (await client.complete(prompt(6), **GREEDY)).finish_reason == "length"


async def test_full_admission_queue_says_when_to_retry(tmp_path):
    daemon = Daemon(tmp_path, engine="max_num_seqs = 1", server="max_queue = 2", gate=True)
    daemon.wait_serving()
    gate = daemon.gate
    try:
        async with Client(daemon.address, max_retries=0) as client:
            long = dict(max_tokens=480, temperature=0.0, ignore_eos=True)
            gate.close()  # none of them can finish: each step waits for the test
            tasks = [asyncio.ensure_future(client.complete(prompt(i), **long)) for i in range(3)]
            await gate.wait_admitted(3)
            await gate.wait_held()
            for _ in range(2):  # a step takes what was admitted, the next schedules it all
                await gate.step()
            info = await client.server_info()
            assert (info.running, info.waiting) == (1, 2)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await client.complete(prompt(9), **long)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            retry = dict(error.value.trailing_metadata())["retry-after-ms"]
            assert int(retry) >= 100
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            gate.open()
            await wait_idle(client)
    finally:
        gate.open()
        assert daemon.stop() == 0


async def test_bearer_token_is_required_when_configured(tmp_path):
    daemon = Daemon(tmp_path, server='bearer_token = "s3cret"')
    daemon.wait_serving()
    try:
        for token in (None, "wrong"):
            async with Client(daemon.address, token=token, max_retries=0) as client:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await client.complete(prompt(1), **GREEDY)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with Client(daemon.address, token="s3cret") as client:
            assert (await client.complete(prompt(1), **GREEDY)).finish_reason == "length"
    finally:
        assert daemon.stop() == 0


async def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path):
    daemon = Daemon(tmp_path, server=f"drain_grace_s = {DRAIN_GRACE_S}", gate=True)
    daemon.wait_serving()
    gate = daemon.gate
    async with Client(daemon.address, max_retries=0) as client:
        options = dict(max_tokens=480, temperature=0.0, ignore_eos=True)
        gate.close()  # they are in flight until the test lets them go on
        try:
            tasks = [asyncio.ensure_future(client.complete(prompt(i), **options))
                     for i in range(3)]
            await gate.wait_admitted(3)
            await gate.wait_held()
            while (await client.server_info()).running < 3:  # two steps at most
                await gate.step()
            daemon.terminate()
            assert await not_serving(daemon) == 2  # NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await client.complete(prompt(7), **GREEDY)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            gate.open()
        for completion in await asyncio.gather(*tasks):
            assert completion.finish_reason == "length" and len(completion.token_ids) == 480
    assert daemon.stop() == 0


async def not_serving(daemon):
    """The health status once it is no longer SERVING (the signal is handled
    on the daemon's own time)."""
    end = time.monotonic() + HEALTH_TIMEOUT_S
    while (status := daemon.health()) == 1 and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return status


async def test_sd_notify_messages_in_order(tmp_path):
    import socket

    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(60)
    daemon = Daemon(tmp_path, env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"})
    messages = []
    try:
        while "READY=1" not in messages:
            messages.append(sock.recv(4096).decode())
        while "WATCHDOG=1" not in messages:
            messages.append(sock.recv(4096).decode())
        daemon.terminate()
        while "STOPPING=1" not in messages:
            messages.append(sock.recv(4096).decode())
    finally:
        assert daemon.stop() == 0
        sock.close()
    ready = messages.index("READY=1")
    assert messages[0] == "STATUS=starting"
    assert any(m.startswith("STATUS=loading target") for m in messages[:ready])
    assert all(m.startswith("STATUS=") for m in messages[:ready])
    assert ready < messages.index("WATCHDOG=1") < messages.index("STOPPING=1")


async def test_final_event_type(daemon):
    async with Client(daemon.address) as client:
        events = [e async for e in client.generate(prompt(8), **GREEDY)]
    assert isinstance(events[-1], Final) and all(isinstance(e, Chunk) for e in events[:-1])


async def test_an_engine_fault_is_internal_and_the_daemon_keeps_serving(tmp_path):
    """In-process server so the fault can be injected into the engine."""
    from tests.support.inprocess import serving_engine

    target, draft = tiny_pair(tmp_path)
    engine = Engine(load_model(target), load_model(draft), None,
                    EngineConfig(block_size=4, num_blocks=256, spec_k=2))
    verify = engine.executor.verifier.verify
    faults = []

    def faulty(batch, proposal):
        doomed = engine.requests.get("doomed")
        seq_ids = {seq.seq_id for seq in doomed.sequences} if doomed else set()
        if any(work.seq_id in seq_ids for work in batch) and not faults:
            faults.append(1)
            raise RuntimeError("injected fault")
        return verify(batch, proposal)

    engine.executor.verifier.verify = faulty
    async with serving_engine(engine) as served, Client(served.address, max_retries=0) as client:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.complete(prompt(1), request_id="doomed", **GREEDY)
        assert error.value.code() == grpc.StatusCode.INTERNAL
        assert "injected fault" in error.value.details()
        completion = await client.complete(prompt(2), **GREEDY)
        assert completion.finish_reason == "length"
    assert engine.pool.stats().in_use == 0
    engine.pool.check_integrity()


async def test_client_retries_when_the_queue_is_full(tmp_path):
    daemon = Daemon(tmp_path, engine="max_num_seqs = 1", server="max_queue = 1")
    daemon.wait_serving()
    try:
        # A retry waits at least the server's retry-after-ms (>= 100 ms), so
        # this many is minutes: a bound on a hang, not a guess at the speed.
        async with Client(daemon.address, max_retries=RETRIES, backoff_s=0.05) as client:
            options = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
            completions = await asyncio.gather(
                *(client.complete(prompt(i), **options) for i in range(4)))
            ends = [(len(c.token_ids), c.finish_reason) for c in completions]
            assert ends == [(40, "length")] * 4
    finally:
        assert daemon.stop() == 0


async def test_metrics_endpoint_and_cli_client(tmp_path):
    import urllib.request

    from tests.support.daemon import free_port

    metrics_port = free_port()
    daemon = Daemon(tmp_path, server=f"metrics_port = {metrics_port}")
    daemon.wait_serving()
    try:
        async with Client(daemon.address) as client:
            await client.complete(prompt(1), **GREEDY)
            await wait_idle(client)
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specpage", "generate", "--server", daemon.address,
            "--max-tokens", "3", "--raw", "--draft", "some-draft", "hello",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await cli.communicate()
        assert cli.returncode == 1
        notice, error = err.decode().splitlines()
        assert notice == ("specpage generate: --draft is ignored with --server: the daemon "
                          "runs its own draft (specpage info shows which)")
        assert "INVALID_ARGUMENT" in error  # no tokenizer: clear error
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=5).read().decode()
        model = f'model_name="{daemon.config.parent / "models" / "target"}"'
        assert f'specpage_requests_finished_total{{{model},reason="length"}} 1.0' in body
        assert 'specpage_kv_blocks{state="in_use"} 0.0' in body
        assert f"specpage_time_to_first_token_seconds_count{{{model}}} 1.0" in body
        assert "specpage_drafted_tokens_total" in body
        assert "specpage_per_token_acceptance_ratio" in body
        info = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specpage", "info", "--server", daemon.address,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, _ = await info.communicate()
        assert info.returncode == 0, out
        state = json.loads(out)
        assert state["running"] == 0 and state["pool"]["in_use"] == 0
        # 64-bit counters as JSON numbers, not the strings protobuf's JSON mapping makes
        assert type(state["drafted_tokens"]) is int and state["drafted_tokens"] > 0
        assert type(state["accepted_tokens"]) is int and type(state["preemptions"]) is int
        assert 0 <= state["acceptance"] <= 1
    finally:
        assert daemon.stop() == 0


async def test_abort_rpc_ends_the_stream_and_reflection_lists_the_service(daemon):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    gate = daemon.gate
    async with Client(daemon.address) as client:
        events = client.generate(prompt(3, 20), request_id="to-abort", max_tokens=400,
                                 temperature=0.0, ignore_eos=True)
        gate.close()  # the request is still running when the abort comes
        try:
            first = asyncio.ensure_future(anext(events))
            await gate.wait_held()
            gate.allow()  # the prefill: the first token
            assert isinstance(await first, Chunk)
            assert await client.abort("to-abort")
        finally:
            gate.open()
        rest = [event async for event in events]
        assert isinstance(rest[-1], Final) and rest[-1].finish_reason == "abort"
        assert not await client.abort("to-abort")  # gone
        await wait_idle(client)
    with grpc.insecure_channel(daemon.address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "specpage.v1.Generation" in services and "grpc.health.v1.Health" in services


async def test_reflection_v1_and_v1alpha_list_every_service(daemon):
    """grpcurl asks v1 first; older clients ask v1alpha. Same messages, two names."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="grpc.reflection.v1.ServerReflection")]
    async with grpc.aio.insecure_channel(daemon.address) as channel:
        for version in ("v1", "v1alpha"):
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            listing, file = [response async for response in call(iter(requests))]
            assert sorted(s.name for s in listing.list_services_response.service) == [
                "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection", "specpage.v1.Generation"]
            [proto] = file.file_descriptor_response.file_descriptor_proto
            v1 = descriptor_pb2.FileDescriptorProto.FromString(proto)
            assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto",
                                             "grpc.reflection.v1")
            assert v1.service[0].method[0].input_type == (
                ".grpc.reflection.v1.ServerReflectionRequest")
