import subprocess
import sys

from swarm.cli import build_parser, main


def test_help_lists_every_command(capsys):
    parser = build_parser()
    text = parser.format_help()
    for cmd in ("generate", "join", "key", "status", "chat"):
        assert cmd in text


def test_a_usage_error_is_one_line_with_a_hint():
    """argparse's own errors read as the commands' checks do: one line, no usage block."""
    proc = subprocess.run([sys.executable, "-m", "swarm", "generate"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["colibri-swarm generate: error: the following arguments are required: "
                                        "prompt (see `colibri-swarm generate --help`)"]


def test_version(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert "colibri-swarm 0.1.0" in capsys.readouterr().out


import pytest


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "hi", "--seed", "-1"], "seed must be at least 0"),
        (["join", "--verify", "200"], "percentage from 0 to 100"),
        (["join", "--verify", "nan"], "percentage from 0 to 100"),
        (["join", "--memory", "-5"], "memory budget (MiB) must be at least 1"),
        (["join", "--signal", "ftp://host:1"], "signaling runs over TLS only"),
        (["join", "--signal", "10.0.0.2"], "names no port"),
        (["join", "--max-batch", "65"], "--max-batch must be at most 64"),
        (["join", "--gpu-memory", "0"], "--gpu-memory (MiB) must be at least 1"),
        (["join", "--gpu-memory", "8G"], "--gpu-memory (MiB) must be a whole number, got '8G'"),
        (["join", "--gpu-memory", str(2**30 + 1)], "--gpu-memory (MiB) must be at most 1073741824"),
        # contradictions, refused before the model is opened (a missing file would be named first)
        (["join", "--no-model", "--model", "/nonexistent.gguf"], "--no-model joins without a model file, but --model"),
        (["join", "--gpu-memory", "100", "--model", "/nonexistent.gguf"], "--gpu-memory 100 sizes the GPU"),
        (["generate", "hi", "--threads", "100000"], "--threads must be at most 1024"),
    ],
)
def test_bad_option_values_get_one_clear_line(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gpu_memory_cap_is_what_a_hello_may_announce():
    """The CLI writes messages.MAX_GPU_MEMORY in MiB as a literal; --gpu-memory with --gpu off is refused."""
    from swarm.cli.join import check_gpu_memory
    from swarm.errors import SwarmError
    from swarm.peer.net.messages import MAX_GPU_MEMORY

    assert build_parser().parse_args(["join", "--gpu-memory", str(MAX_GPU_MEMORY >> 20)]).gpu_memory << 20 == MAX_GPU_MEMORY
    with pytest.raises(SwarmError, match="--gpu is off: add --gpu auto or --gpu on"):
        check_gpu_memory("off", 8192)
    check_gpu_memory("on", 8192)
    check_gpu_memory("off", None)


def test_max_batch_cap_is_the_servings():
    """The CLI keeps numpy out of its start, so it writes serving's MAX_BATCH_LIMIT as a literal."""
    from swarm.compute.serving import MAX_BATCH_LIMIT, set_default_limits

    assert build_parser().parse_args(["join", "--max-batch", str(MAX_BATCH_LIMIT)]).max_batch == MAX_BATCH_LIMIT
    with pytest.raises(SystemExit):
        build_parser().parse_args(["join", "--max-batch", str(MAX_BATCH_LIMIT + 1)])
    with pytest.raises(ValueError, match=f"1..{MAX_BATCH_LIMIT}"):
        set_default_limits(max_batch=MAX_BATCH_LIMIT + 1)


def test_good_option_values_parse():
    args = build_parser().parse_args(["join", "--verify", "12.5", "--memory", "512", "--signal", "10.0.0.2:8443"])
    assert (args.verify, args.memory, args.signal) == (12.5, 512, "wss://10.0.0.2:8443/ws")
    assert args.layout == "auto"  # the cost model picks local, ranges or stages (docs/planner.md)


@pytest.mark.parametrize("form", ["10.0.0.2:8443", "https://10.0.0.2:8443", "https://10.0.0.2:8443/",
                                  "wss://10.0.0.2:8443", "wss://10.0.0.2:8443/ws"])
def test_every_documented_signal_form_becomes_one_url(form):
    assert build_parser().parse_args(["join", "--signal", form]).signal == "wss://10.0.0.2:8443/ws"


def test_sampling_params_refuse_a_negative_seed():
    from swarm.compute import SamplingParams

    with pytest.raises(ValueError, match="seed must be >= 0"):
        SamplingParams(seed=-1)


def _run(argv, config_dir, timeout=60):
    env = {**__import__("os").environ, "COLIBRI_SWARM_CONFIG_DIR": str(config_dir)}
    env.pop("COLIBRI_SWARM_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("url, needle", [
    ("notaurl", "is not an http(s) URL"),
    ("ftp://10.0.0.2:8443/v1", "is not an http(s) URL"),
    ("https://:8443/v1", "names no host"),
    ("https://10.0.0.2:99999/v1", "is not a valid URL"),
    ("https://10.0.0.2:port/v1", "is not a valid URL"),
])
def test_a_bad_api_url_is_refused_as_it_is_parsed(tmp_path, command, url, needle):
    """Before the swarm key is looked for (this config directory has none)."""
    argv = [command, "--api", url] + (["hi"] if command == "generate" else [])
    proc = _run(argv, tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"colibri-swarm {command}: error: argument --api: ")
    assert needle in lines[0] and "swarm key" not in lines[0]


@pytest.mark.parametrize("given, url", [("https://10.0.0.2:8443", "https://10.0.0.2:8443/v1"),
                                        ("https://10.0.0.2:8443/v1/", "https://10.0.0.2:8443/v1"),
                                        ("http://localhost:8000/v1", "http://localhost:8000/v1")])
def test_an_api_url_is_normalised(given, url):
    assert build_parser().parse_args(["generate", "--api", given, "hi"]).api == url


@pytest.fixture
def no_key(tmp_path, monkeypatch):
    """A config directory without a swarm key: checks that pass would end in "no swarm key"."""
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv("COLIBRI_SWARM_API_KEY", raising=False)
    return tmp_path


@pytest.mark.parametrize("argv, needle", [
    (["chat", "--temperature", "-2"], "--temperature -2.0: must be ≥ 0"),
    (["chat", "--max-tokens", "0"], "--max-tokens 0: must be at least 1"),
    (["chat", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["chat", "--temperature", "2.5"], "--temperature 2.5: must be ≥ 0 and ≤ 2"),
    (["generate", "--swarm", "--temperature", "2.5", "hi"], "--temperature 2.5: must be ≥ 0 and ≤ 2"),
    (["generate", "--swarm", ""], "the prompt is empty"),
    (["generate", "   "], "the prompt is empty"),
    (["generate", "--swarm", "--model", "/nonexistent.gguf", "hi"], "--model picks a model file for this machine"),
    (["generate", "--api", "https://10.0.0.2:8443/v1", "--model", "/nonexistent.gguf", "hi"], "drop --model"),
    (["generate", "--local", "--swarm", "hi"], "--local runs on this machine alone"),
    (["generate", "--swarm", "--raw", "--system", "be brief", "hi"], "--system has no effect with --raw"),
])
def test_generate_and_chat_check_their_arguments_before_any_work(no_key, capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and needle in err, err


def test_the_cli_and_the_api_agree_on_the_highest_temperature():
    from swarm.cli.generate import sampling_kwargs
    from swarm.compute.textgen import MAX_TEMPERATURE
    from swarm.peer.coordinator.api_request import ApiError, parse_chat_request

    body = {"messages": [{"role": "user", "content": "hi"}]}
    args = build_parser().parse_args(["chat", "--temperature", str(MAX_TEMPERATURE)])
    assert sampling_kwargs(args)["temperature"] == MAX_TEMPERATURE
    assert parse_chat_request({**body, "temperature": MAX_TEMPERATURE}, model_id="m", max_tokens_limit=8).temperature \
        == MAX_TEMPERATURE
    with pytest.raises(ApiError, match="temperature"):
        parse_chat_request({**body, "temperature": MAX_TEMPERATURE + 0.01}, model_id="m", max_tokens_limit=8)


def test_join_at_a_signal_address_without_that_swarms_key_is_refused(tmp_path):
    """A new key made here could never join the swarm at --signal: no key is created, nothing is dialled."""
    proc = _run(["join", "--signal", "10.0.0.2:8443"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "colibri-swarm: error: --signal joins an existing swarm, whose key this machine does not have: add "
        "--key CODE (`colibri-swarm key` on a peer of that swarm shows it)"]
    assert not (tmp_path / "swarm.key").exists() and not any(tmp_path.iterdir())


def test_join_hosts_its_signaling_server_on_the_port_asked_for(tmp_path):
    """`join --port N`: the signaling server this peer hosts listens on N (status says so), so a
    `--signal HOST:N` handed out stays valid."""
    import json
    import os
    import signal
    import socket
    import time

    from swarm.peer.status import STATUS_FILE
    from swarm.keys.swarmkey import SwarmKey

    with socket.socket() as s:  # a port free now
        s.bind(("", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "COLIBRI_SWARM_CONFIG_DIR": str(tmp_path)}
    key = SwarmKey(os.urandom(32)).code  # a swarm of its own: this peer hosts the signaling server
    proc = subprocess.Popen([sys.executable, "-m", "swarm", "join", "--no-model", "--key", key, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        hosted = None
        for _ in range(600):  # until the status file names the port, or the peer exits
            if proc.poll() is not None:
                break
            try:
                hosted = json.loads((tmp_path / STATUS_FILE).read_text()).get("signaling_port")
            except (OSError, ValueError):
                hosted = None
            if hosted:
                break
            time.sleep(0.2)
        assert hosted == port, proc.stderr.read().decode() if proc.poll() is not None else hosted
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.mark.parametrize("value, needle", [("0", "the port must be at least 1"),
                                           ("70000", "the port must be at most 65535")])
def test_a_bad_join_port_is_refused(value, needle):
    proc = subprocess.run([sys.executable, "-m", "swarm", "join", "--port", value], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr


def test_join_at_a_port_in_use_ends_with_one_clear_line(tmp_path):
    """Waiting would not free a port the user fixed: join ends, naming the port and what to do."""
    import os
    import socket

    from swarm.keys.swarmkey import SwarmKey

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _run(["join", "--no-model", "--key", SwarmKey(os.urandom(32)).code, "--port", str(port)], tmp_path,
                    timeout=180)
    assert proc.returncode == 2
    assert (f"colibri-swarm: error: cannot host the signaling server on port {port}: " in proc.stderr
            and "address already in use; pick another with join --port N" in proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("loop, slow_check, runs_on, why", [
    ("auto", False, "uvloop (uvloop.Loop)", None),
    ("asyncio", False, "asyncio (asyncio.unix_events._UnixSelectorEventLoop)", None),
    ("uvloop", True, "asyncio (asyncio.unix_events._UnixSelectorEventLoop)", "the slow-callback check times"),
])
def test_join_runs_on_the_event_loop_asked_for(tmp_path, loop, slow_check, runs_on, why):
    """A real `join` process logs the class of the loop it runs on: uvloop by default, asyncio's
    when asked for, and asyncio's (saying why) while the slow-callback check is on."""
    import os
    import signal
    import time

    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.loopwatch import SLOW_CALLBACK_ENV

    env = {k: v for k, v in os.environ.items() if k != SLOW_CALLBACK_ENV}
    env.update({"COLIBRI_SWARM_CONFIG_DIR": str(tmp_path), **({SLOW_CALLBACK_ENV: "0.5"} if slow_check else {})})
    log = tmp_path / "join.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "swarm", "-v", "join", "--no-model", "--loop", loop,
                                 "--key", SwarmKey(os.urandom(32)).code], stdout=subprocess.DEVNULL, stderr=err,
                                env=env)
    try:
        want = 1 if why is None else 2  # with a reason, the line saying why comes first
        for _ in range(600):  # until the peer says which loop it runs on, or exits
            if proc.poll() is not None or log.read_text().count("event loop: ") >= want:
                break
            time.sleep(0.1)
        lines = [line for line in log.read_text().splitlines() if "event loop: " in line]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert lines and lines[-1].endswith(f"event loop: {runs_on}"), log.read_text()[-3000:]
    assert (why is None) == (len(lines) == 1) and (why is None or why in lines[0]), lines


def test_join_prints_every_threads_stack_on_sigusr1_and_runs_on():
    # What `join` registers at start: a hung peer shows where it waits, and SIGUSR1 ends nothing.
    code = ("import os, signal, threading\n"
            "from swarm.cli.join import dump_stacks_on_sigusr1\n"
            "dump_stacks_on_sigusr1()\n"
            "def parked_helper_thread(): threading.Event().wait(5)\n"
            "threading.Thread(target=parked_helper_thread, daemon=True).start()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "print('still running')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "still running\n"
    assert "parked_helper_thread" in done.stderr and "Current thread" in done.stderr


def test_join_prints_a_role_once_and_its_api_port_when_it_comes_up():
    """A coordinator's API comes up after its role: the port gets a line of its own, the role is
    not printed a second time; a new role is printed with the port where the API is up."""
    from swarm.cli.join import role_lines

    assert role_lines(None, "coordinator", None) == ["role: [bold]coordinator[/]"]
    assert role_lines("coordinator", "coordinator", 41535) == ["OpenAI API on port 41535"]
    assert role_lines("worker", "coordinator", 41535) == ["role: [bold]coordinator[/], OpenAI API on port 41535"]
    assert role_lines("coordinator", "worker", None) == ["role: [bold]worker[/]"]
    assert role_lines("worker", "worker", None) == []
