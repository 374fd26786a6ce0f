"""The server's routers, each mounted by `server.app.create_app`: ops (health, metrics), openai
(models, completions, chat) and kb (knowledge-base documents and stats). A web page mounts the same way."""
