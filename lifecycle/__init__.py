"""The account's whole life across the apps: the holder's data download and the account's
closure. It sits above the apps and asks each, in plain sight, what it holds about a person
and whether it can let them go (as the agent protocol sits above the apps it calls)."""
