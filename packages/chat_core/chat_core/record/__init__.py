"""The record of an episode and what is read from it: how it went (``results``, what ``play`` returns), the outcome
both trainer helpers keep in a sample (``outcome``), the rules their filters apply to a group (``filters``) and the
per-episode metrics their log functions report (``metrics``). Plain data: nothing here loads a network client, so a
trainer's filter and log functions don't either."""
