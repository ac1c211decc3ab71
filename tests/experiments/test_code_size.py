"""experiments/lib/code_size.py counts code lines without blanks, comments and docstrings."""

from lib import code_size

SOURCE = '''"""Module docstring,
two lines."""
import os  # a comment on a code line


# a comment line
class A:
  """Class docstring."""
  x = """a string value
over two lines"""

  def f(self):
    """Function docstring."""
    return (1 +
            2)
'''


def test_counts_only_code_lines():
  # import, class, x = (2 lines), def, return (2 lines)
  assert code_size.code_lines(SOURCE) == 7
  assert code_size.docstring_lines(SOURCE) == {1, 2, 8, 13}


def test_an_empty_function_body_docstring_only():
  assert code_size.code_lines('def f():\n  """Doc."""\n') == 1
