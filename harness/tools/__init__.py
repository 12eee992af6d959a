"""Command tools, each with its own main(); nothing that a run imports: bench, plan, zero-plan, chat, push."""
