"""hy3spark_secret: read a secret by environment-variable NAME, without it ever passing through runner artifacts.

`lookup('hy3spark.cluster.hy3spark_secret', 'HF_TOKEN')` returns, in order:
1. the controller's environment variable (the `ansible-playbook site.yml` path: the user exported it);
2. the same NAME from the 0600 file named by HY3SPARK_SECRETS_FILE (the `hy3spark up` path: ansible-runner copies
   the child's whole environment into artifacts/*/command, so the CLI takes secrets out of the environment and
   hands them over in a file that only this user can read and that is deleted after the run);
3. '' when neither has it (with `required=true`: an error that names the variable, never a value).
Tasks using it must be `no_log: true`.
"""

from __future__ import annotations

import os
import stat

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: hy3spark_secret
short_description: Read a secret by env var name from the environment or the hy3spark secrets file
description:
  - Returns the value of the named environment variable on the controller, else the same name from the file
    named by C(HY3SPARK_SECRETS_FILE) (KEY=VALUE lines, mode 0600), else an empty string.
options:
  _terms:
    description: Environment variable names.
    required: true
  required:
    description: Fail, naming the variable, when it is not set anywhere.
    type: bool
    default: false
"""


def _from_file(name: str) -> str | None:
    path = os.environ.get("HY3SPARK_SECRETS_FILE")
    if not path:
        return None
    st = os.stat(path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise AnsibleLookupError(f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); it must be 0600")
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            key, sep, value = line.rstrip("\n").partition("=")
            if sep and key == name:
                return value
    return None


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):  # Ansible's plugin signature, untyped
        self.set_options(var_options=variables, direct=kwargs)
        required = self.get_option("required")
        values = []
        for name in terms:
            value = os.environ.get(name)
            if value is None:
                value = _from_file(name)
            if value is None:
                if required:
                    raise AnsibleLookupError(
                        f"the secret {name} is not set: export {name}=... on the controller before running"
                    )
                value = ""
            values.append(value)
        return values
