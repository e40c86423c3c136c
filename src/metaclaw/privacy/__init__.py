"""What the adapter learns stays the user's (docs/privacy.md): secrets are never stored, judged or trained on;
personal data follows a per-category policy; `forget` deletes a user's data down to the file bytes.

- `detect`: where secrets and personal data are in a text (`detect-secrets`' plugins, our own patterns, entropy,
  `phonenumbers`, Luhn, IBAN checksums);
- `policy`: `PrivacyPolicy`, applied by the store to every sample before it is written, and the redacted views
  of outbound calls (`outbound`: the judge, teacher and evolver wrappers);
- `forget`: deleting samples, session rows and evolved skills; the retention sweep;
- `corpus`: the synthetic test corpus (`bench/studies/redaction.py`).
"""

from metaclaw.privacy.detect import PII_CATEGORIES, Finding, find_pii, find_secrets, redact
from metaclaw.privacy.policy import DEFAULT_PII, PrivacyPolicy

__all__ = [
    "DEFAULT_PII",
    "PII_CATEGORIES",
    "Finding",
    "PrivacyPolicy",
    "find_pii",
    "find_secrets",
    "redact",
]
