"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the chat
completions path: ``protocol`` (the bodies), ``conversion`` (to a chat request),
``serving_messages`` (the endpoints, replies, stream events and errors)."""
