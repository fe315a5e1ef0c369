"""The GPU check runs every GPU test of the suite, however it picks the files to collect."""
import pathlib

from benchmarks import gpu_check


def test_every_test_marked_gpu_is_in_a_file_the_gpu_check_collects(request):
  # This run collected the whole suite (a file or -k run would prove nothing: then the
  # files of the GPU tests it did collect must still be among the check's).
  root = pathlib.Path(gpu_check.REPO_ROOT)
  files_of_gpu_tests = {str(pathlib.Path(item.fspath).relative_to(root))
                        for item in request.session.items if item.get_closest_marker("gpu")}
  assert files_of_gpu_tests <= set(gpu_check.gpu_test_files())
  # And it picks only files that hold GPU tests: the check does not collect the suite.
  assert len(gpu_check.gpu_test_files()) < len(list((root / "tests").glob("test_*.py"))) / 4


def test_the_gpu_tests_include_the_kernels_run_only_on_a_gpu():
  # The two tests that skip without a GPU but were once unmarked, and the grouped GEMMs'.
  files = gpu_check.gpu_test_files()
  for name in ("test_cast_transpose.py", "test_attention_semantics.py",
               f"{gpu_check.GROUPED_GEMM_TESTS}.py"):
    assert f"tests/{name}" in files, files
