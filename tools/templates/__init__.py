"""The example workflows users start from (``workflows/``): written here, not by hand, so that every template is laid
out by one rule and names the released files users download. Developers run these after changing a graph.

* :mod:`~tools.templates.make_workflows` (and :mod:`~tools.templates.families`): the graphs, their layout and notes.
* :mod:`~tools.templates.make_thumbnails`: each template's card in the template browser.
* :mod:`~tools.templates.models`, :mod:`~tools.templates.release`: the released files a template names, and the
  fixture each is swapped for in tests.
* :mod:`~tools.templates.workflow_api`: a saved workflow (UI format) turned into what ``POST /prompt`` takes.
"""
