"""Agents as they are written: an OpenAI-compatible endpoint over the run's engine, whose
calls are recorded token in, token out as multi-turn episodes (docs/tools.md).

- `server.Gateway`: `POST /v1/chat/completions`, `GET /v1/models` on 127.0.0.1 (uvicorn in
  its own thread and event loop), requests waiting together batched into the engine;
- `trajectory.AgentEpisode`: an episode's ids across its calls (observations appended as
  ids, never re-encoding; a rewritten history starts a new segment);
- `agents`: `task.agent` run G times per problem, timeouts and errors dropped and counted,
  the episodes as the step's groups.
"""
