"""The front end: the HTTP surface (routes, limits, API keys, the V2 codec's calls), the data
plane above one engine client, and the remote client's arena, engine links and routing.
Importing it loads none of the engine's code (``tests/unit/app/test_rooms.py``)."""
