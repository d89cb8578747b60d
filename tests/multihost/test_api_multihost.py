"""The API as seen from another machine (another network namespace): HTTPS only, the derived token
only. Plain HTTP gets no answer, the key code is refused, and the official ``openai`` client
works with the CA certificate ``colibri-swarm key`` exports."""

from __future__ import annotations

import os

import pytest

from swarm.keys.swarmkey import SwarmKey
from tests.multihost.test_mesh_multihost import read_status, until
from tests.peer._swarm_models import add_char_tokenizer, build

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

# Runs in the client's namespace: what plain HTTP, the key code and the exported CA each get.
PROBE = """
import json, sys, urllib.request, openai
url, token, code = sys.argv[1:4]
out = {}
try:
    urllib.request.urlopen(urllib.request.Request(url.replace("https://", "http://") + "/models",
                           headers={"Authorization": f"Bearer {token}"}), timeout=20)
    out["plain"] = "answered"
except Exception as exc:
    out["plain"] = repr(exc)[:300]
for name, key in (("code", code), ("token", token)):
    try:
        out[name] = [m.id for m in openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60).models.list()]
    except Exception as exc:
        out[name] = type(exc).__name__
print(json.dumps({"event": "probe", **out}), flush=True)
"""


async def test_api_from_another_namespace_is_https_and_token_only(netns_lab):
    from swarm.peer.coordinator.api_tls import write_ca

    lab = netns_lab(2)
    model_dir = add_char_tokenizer(build("olmoe", lab.workdir))
    key = SwarmKey(os.urandom(32))
    peer = lab.spawn(0, ["-m", "swarm", "-v", "join", "--model", str(model_dir), "--key", key.code, "--name", "host0"],
                     env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    await until(lambda: ((read_status(lab, 0) or {}).get("placement") or {}).get("api_port"), 90,
                "host0 coordinating with its API up", [peer])
    placement = read_status(lab, 0)["placement"]
    assert placement["api_scheme"] == "https"
    ca = write_ca(key, lab.workdir)
    url = f"https://{lab.addresses[0]}:{placement['api_port']}/v1"
    probe = lab.spawn(1, ["-c", PROBE, url, key.api_token, key.code], env={"SSL_CERT_FILE": str(ca)})
    result = await probe.wait_for(lambda e: e.get("event") == "probe", 120)
    assert result["plain"] != "answered", result  # plain HTTP to the API's port: no HTTP answer at all
    assert result["code"] == "AuthenticationError", result  # the key code is never a bearer token
    assert result["token"] == [model_dir.name], result  # the derived token, over HTTPS, with the exported CA
