"""The rendezvous' rules, pure: data in, decisions out, no store, no thread, no clock but
the one injected, so that every rule is tested without a store."""
