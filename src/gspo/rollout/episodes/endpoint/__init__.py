"""The recording endpoint of the agent episode (``gspo.rollout.episodes.agent``, docs/agents.md).

* ``server``: the OpenAI-compatible HTTP server on 127.0.0.1 with a per-batch key;
* ``recorder``: every call's ids stitched into training rows, one record per episode;
* ``batcher``: concurrent episodes' calls gathered into the engine's calls, deterministically.

It serves nothing by itself: the agent episode opens it for each batch and closes it after.
"""
