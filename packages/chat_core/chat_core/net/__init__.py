"""chat_core's connections: HTTP through aiohttp and the env server's WebSocket sessions through websockets, set up
once per event loop and per process. Everything the stages send or read goes through here; nothing here knows an
OpenEnv server or a chat completion."""
