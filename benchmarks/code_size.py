"""Count the modules over N lines and the functions over M lines of a source tree (an ``ast``
walk; a function's length is its ``end_lineno - lineno + 1``, decorators excluded).

    python benchmarks/code_size.py src/pagedkv            # modules > 500, functions > 100 lines
    python benchmarks/code_size.py src/pagedkv --module-lines 400 --function-lines 60
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--module-lines", type=int, default=500)
    parser.add_argument("--function-lines", type=int, default=100)
    args = parser.parse_args()
    modules, functions = [], []
    for path in sorted(args.root.rglob("*.py")):
        text = path.read_text()
        num_lines = text.count("\n")
        if num_lines > args.module_lines:
            modules.append((num_lines, str(path)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > args.function_lines:
                    functions.append((length, f"{path}:{node.lineno} {node.name}"))
    print(f"{len(modules)} modules over {args.module_lines} lines")
    for num_lines, name in sorted(modules, reverse=True):
        print(f"  {num_lines:5d} {name}")
    print(f"{len(functions)} functions over {args.function_lines} lines")
    for length, name in sorted(functions, reverse=True):
        print(f"  {length:5d} {name}")


if __name__ == "__main__":
    main()
