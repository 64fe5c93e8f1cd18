"""The OpenAI-compatible endpoint (`rollout.agent.program`, docs/agents.md): a user's agent program calls
`/v1/chat/completions` and every turn it takes becomes tokens the policy is trained on.

- `gateway.py`: `AgentGateway`, the engine around the engine that runs the programs (agents/programs/) and serves them;
- `server.py`: the HTTP server (FastAPI under uvicorn), its limits, the session table (`Pending`, `Tally`, `Gate`);
- `schema.py`: the request and answer shapes of the Chat Completions API, read strictly (`BadRequest`);
- `scheduler.py`: requests batched into engine calls or joined to a continuous batch;
- `jobs.py`: one request matched to its session (the prefix it extends) and prepared for the engine;
- `answers.py`: an engine completion shaped into an OpenAI answer (text, tool calls, finish reason).

It stands above agents/programs/ and agents/loop/ (the gateway runs programs and renders turns with the
loop's renderer) and below agents/verifiers/ (a verifiers environment is served through it).
"""
