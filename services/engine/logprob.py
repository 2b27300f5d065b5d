"""vLLM's ``Logprob`` for the offline ``LLM`` (defined torch-free in ``services.types.logprob``,
where the gateway's beam search reads it too)."""

from services.types.logprob import DecodeToken, Logprob, logprob_entries

__all__ = ["DecodeToken", "Logprob", "logprob_entries"]
