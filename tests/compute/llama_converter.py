"""llama.cpp's own HF → GGUF converter (``convert_hf_to_gguf.py``), for checking that the files
users make with it load: the copy of llama.cpp's source shipped in the ``llama-cpp-python`` sdist
on PyPI, pinned to :data:`VERSION`.

Only ``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/`` and ``models/templates/`` (the chat
templates of released models, which the API's tool formats are checked against) are kept, in
``$COLIBRI_SWARM_LLAMA_CONVERTER`` or else ``<user cache>/llama.cpp-converter-<VERSION>``.
``python3 -m tests.compute.llama_converter`` fetches them there unless present (``.ci/run`` does);
tests never fetch. The converter runs as a subprocess with its own ``gguf-py`` first on the path, so its
gguf package never replaces the installed one the engine reads with. It imports torch,
transformers, numpy and, for llama-family tokenizers, sentencepiece (the test extras).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp's source
ENV_VAR = "COLIBRI_SWARM_LLAMA_CONVERTER"
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")
_CONVERT_TIMEOUT_S = 300


class ConverterMissing(RuntimeError):
    """The converter is not where the tests look for it."""


def converter_dir() -> Path:
    """Where the extracted converter lives (it may not exist yet)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    from swarm.paths import cache_dir

    return cache_dir() / f"llama.cpp-converter-{VERSION}"


def converter_script() -> Path:
    """``convert_hf_to_gguf.py`` of the extracted copy.

    Raises: :class:`ConverterMissing` saying how to fetch it."""
    script = converter_dir() / "convert_hf_to_gguf.py"
    if not (script.is_file() and all((script.parent / part).is_dir()
                                     for part in ("conversion", "gguf-py", "models/templates"))):
        raise ConverterMissing(
            f"llama.cpp's converter is not in {script.parent} (set {ENV_VAR} to move it); fetch it with "
            f"'python3 -m tests.compute.llama_converter' (downloads the llama-cpp-python=={VERSION} sdist "
            "from PyPI and keeps convert_hf_to_gguf.py, conversion/, gguf-py/ and models/templates/)")
    return script


class Conversion:
    """A run of the converter started by :func:`start_convert`; :meth:`wait` for its file."""

    def __init__(self, hf_dir: Path, outfile: Path, outtype: str) -> None:
        script = converter_script()
        env = dict(os.environ, PYTHONPATH=str(script.parent / "gguf-py"))
        self.hf_dir, self.outfile = hf_dir, outfile
        self.log = outfile.with_name(outfile.name + ".log")  # a file, not a pipe: no one need read it while it runs
        with open(self.log, "w") as log:
            self.popen = subprocess.Popen(
                [sys.executable, str(script), str(hf_dir), "--outtype", outtype, "--outfile", str(outfile)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def wait(self) -> Path:
        """The GGUF file once the converter has written it.

        Raises: RuntimeError with the converter's last output lines when it fails; TimeoutExpired
        (the converter killed) after :data:`_CONVERT_TIMEOUT_S` seconds."""
        try:
            code = self.popen.wait(timeout=_CONVERT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if code != 0:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-25:])
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {self.hf_dir} (exit {code}):\n{tail}")
        return self.outfile

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


def start_convert(hf_dir: Path, outfile: Path, outtype: str = "f32") -> Conversion:
    """Start converting the HF checkpoint ``hf_dir`` (config.json, safetensors, tokenizer files)
    into the GGUF file ``outfile`` with llama.cpp's converter, in a subprocess (so that several
    run at once); ``outtype``: its ``--outtype`` (``f32``, ``f16``, ``bf16``, ``q8_0``).

    Raises: :class:`ConverterMissing`."""
    return Conversion(hf_dir, outfile, outtype)


def convert(hf_dir: Path, outfile: Path, outtype: str = "f32") -> Path:
    """:func:`start_convert`, waited for: the GGUF file ``outfile``.

    Raises: :class:`ConverterMissing`; RuntimeError with the converter's last output lines when
    it fails."""
    return start_convert(hf_dir, outfile, outtype).wait()


def chat_template(name: str) -> str:
    """The chat template ``name`` (a file of llama.cpp's ``models/templates/``, e.g.
    ``GLM-4.6.jinja``) as its model ships it.

    Raises: :class:`ConverterMissing` saying how to fetch the copy."""
    return (converter_script().parent / "models" / "templates" / name).read_text(encoding="utf-8")


def fetch(dest: Path) -> Path:
    """Download the pinned sdist with pip and extract the converter's parts into ``dest``."""
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and m.name[len(prefix):].startswith(_KEEP):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            dest.mkdir(parents=True, exist_ok=True)
            tar.extractall(dest, members=members, filter="data")
    return converter_script()


if __name__ == "__main__":
    try:
        print(converter_script())
    except ConverterMissing:
        print(fetch(converter_dir()))
