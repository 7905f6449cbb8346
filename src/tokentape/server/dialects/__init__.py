"""The generation routes' dialects: one module per API family (`registry.DIALECTS` lists them),
translating between its wire format and the gateway's chat and completion turns."""
