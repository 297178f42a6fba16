"""The remote Python sandbox: the `builtin:python` tool's calls sent to an execution service, for
clusters whose hosts cannot make the local sandbox's namespaces (`xray/env/sandbox.py`).

Sits beside the local sandbox in `xray/env/` and answers the same way (`run(code) ->
SandboxResult`). It speaks SandboxFusion's HTTP API (github.com/bytedance/SandboxFusion,
`sandbox/server/sandbox_api.py`), as read from its source:

    POST {url}/run_code   {"code": ..., "language": "python", "run_timeout": seconds,
                           "compile_timeout": seconds, "stdin": "", "files": {}, "fetch_files": []}
    ->  {"status": "Success" | "Failed" | "SandboxError", "message": ...,
         "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time": s,
                        "return_code": int | null, "stdout": ..., "stderr": ...}, ...}

`run_timeout` carries `limits.wall_s`; the service applies its own other limits (memory, processes;
the protocol has no fields for them that this client could confirm), and the isolation is the
service's. Output is cut here to `limits.output_bytes` (reason `output`: the service ran to its
end, the model reads the first bytes). `SandboxError`, a `run_result` with status `Error`, an
HTTP error or no answer within `wall_s + request_timeout_s` raise `RemoteSandboxError`, naming the
service: the tool answers the model with it, the episode goes on.
"""
from __future__ import annotations

import asyncio
from typing import Any

from xray.config.sandbox import SandboxConfig
from xray.env.sandbox import SandboxResult


class RemoteSandboxError(RuntimeError):
    """The execution service failed to run a call (not the program: the service)."""


class RemoteSandbox:
    """Runs Python code on a SandboxFusion service at `config.url` (see the module docstring)."""

    def __init__(self, config: SandboxConfig):
        config.check()
        if not config.url:
            raise ValueError("a remote sandbox needs env.sandbox.url (http://host:port of a SandboxFusion service)")
        self.config, self.url = config, config.url.rstrip("/") + "/run_code"

    def request(self, code: str) -> dict[str, Any]:
        """The request body for `code`."""
        return {"code": code, "language": "python", "run_timeout": self.config.limits.wall_s,
                "compile_timeout": self.config.limits.wall_s, "stdin": "", "files": {}, "fetch_files": []}

    async def run(self, code: str) -> SandboxResult:
        """Run `code` (a Python program) on the service and return how it ended."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.config.limits.wall_s + self.config.request_timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.post(self.url, json=self.request(code)) as response:
                    if response.status != 200:
                        body = (await response.text())[:300]
                        raise RemoteSandboxError(f"the sandbox service at {self.url} answered HTTP {response.status}: "
                                                 f"{body}; check env.sandbox.url and the service's log")
                    answer = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise RemoteSandboxError(f"the sandbox service at {self.url} did not answer ({type(exc).__name__}: {exc}); "
                                     "check that it runs and that env.sandbox.url reaches it") from None
        return self.result(answer)

    def run_sync(self, code: str) -> SandboxResult:
        """`run` from blocking code."""
        return asyncio.run(self.run(code))

    def result(self, answer: dict[str, Any]) -> SandboxResult:
        """A service's answer as the local sandbox's result."""
        run = answer.get("run_result") or {}
        if answer.get("status") == "SandboxError" or run.get("status") not in ("Finished", "TimeLimitExceeded"):
            raise RemoteSandboxError(f"the sandbox service at {self.url} could not run the program "
                                     f"(status {answer.get('status')!r}, run status {run.get('status')!r}: "
                                     f"{str(answer.get('message') or run.get('stderr') or '')[:300]})")
        budget = self.config.limits.output_bytes
        out = (run.get("stdout") or "").encode()
        err = (run.get("stderr") or "").encode()
        cut = len(out) + len(err) > budget
        out, err = out[:budget], err[:max(budget - len(out), 0)]
        code = run.get("return_code")
        if run["status"] == "TimeLimitExceeded":
            reason, code = "timeout", None
        elif cut:
            reason, code = "output", None
        else:
            reason = "ok" if code == 0 else "error"
        return SandboxResult(out.decode(errors="replace"), err.decode(errors="replace"), code, reason)
