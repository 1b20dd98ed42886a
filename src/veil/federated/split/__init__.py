"""Split learning on Flower (SL, FeSTA, p-FeSTA; Park et al.): head and tail on the client, body on the server."""
