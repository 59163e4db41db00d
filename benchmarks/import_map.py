"""The import map of a package: its import circles, and who imports a module.

    python benchmarks/import_map.py                         # circles in pagedkv
    python benchmarks/import_map.py --importers pagedkv.engine.scheduler

A circle is a strongly connected component of the graph of direct imports (grimp's graph, the
one ``lint-imports`` checks, with imports under ``if TYPE_CHECKING:`` counted: they couple the
modules as much for a reader). Components are found with networkx (a dependency of torch).
Used for issue 48's before/after figures (docs/design.md, "Import map").
"""

from __future__ import annotations

import argparse

import grimp
import networkx as nx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="pagedkv")
    parser.add_argument("--importers", nargs="*", default=(), help="modules to list importers of")
    args = parser.parse_args()
    graph = grimp.build_graph(args.package)
    edges = nx.DiGraph()
    for module in graph.modules:
        edges.add_node(module)
        for imported in graph.find_modules_directly_imported_by(module):
            edges.add_edge(module, imported)
    circles = [sorted(c) for c in nx.strongly_connected_components(edges) if len(c) > 1]
    print(f"{len(graph.modules)} modules, {edges.number_of_edges()} direct imports")
    print(f"{len(circles)} import circles")
    for circle in sorted(circles, key=lambda c: (-len(c), c)):
        print(f"  {len(circle)}: " + ", ".join(circle))
    for name in args.importers:
        importers = sorted(graph.find_modules_that_directly_import(name))
        print(f"{name} is imported by {len(importers)}: " + ", ".join(importers))


if __name__ == "__main__":
    main()
