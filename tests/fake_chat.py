"""The scripted chat-completions stand-in the real-client tests drive: `ScriptedChat(turns)`.

It is tests/fake_upstream.py's server (one stand-in for OpenAI-compatible upstreams), named here
for the tests that script a conversation; see ScriptedChat's docstring there.
"""

from fake_upstream import ScriptedChat

__all__ = ["ScriptedChat"]
