"""One file per tab: create_ui() builds the layout, create_event_handlers() wires it to the
logic in playground/handlers/. Tabs reach the engine only through AppContext.service (an
EngineClient), or a remote server through AppContext.remote."""
