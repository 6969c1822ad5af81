"""Inference: turning a prompt into tokens, on one node or across the swarm.

    api        the contract between the gateway and whoever generates: GenerationRequest in,
               a stream of TokenEvents out, ending in one Finished (the gateway renders it as
               OpenAI or Anthropic; the generator may be local or a route across peers)
"""
