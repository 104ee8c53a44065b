"""Process state and the background loop (mechanism band): ``context`` (the one
``RuntimeContext``), ``loop`` (``run_coroutine``, shared stores, exit hooks, ``reset``) and
``staging`` (the async save's host copies). Never imports the data plane, transport or api."""
