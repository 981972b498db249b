"""The env server as chat_core sees it: the OpenEnv wire's plain types and the ways a server can fail a caller
(``protocol``, ``errors``, which load no client), its Task API and an episode's WebSocket session, and a pool of
servers serving one bundle."""
