"""`difftune lora`: tools for any LoRA file of a family difftune trains, whoever wrote it.

Each verb is a plain function (inspect, verify) that the CLI (`verbs.lora`) and the web app
call. They read files through `adapters.formats.load_lora_file` and name modules through the
family's own facts (its tiny denoiser's module names and its single-file layout, `names`), so
a family joins by its folder alone.
"""
