"""cloud_adapters/redaction.py: what is removed from log lines and adapter errors, and what is not."""

from __future__ import annotations

import json
import logging
import uuid

from cloud_adapters.base import CredentialsError, ProviderError
from cloud_adapters.redaction import REDACTED, redact, register


def test_credential_shapes_are_redacted_whoever_made_them():
    jwt = "eyJhbGciOiJSUzI1NiJ9.eyJpc3MiOiJ4QHkifQ.c2lnbmF0dXJlLW9mLXRoZS10b2tlbg"
    text = (f"Authorization: Bearer {jwt}; AWS4-HMAC-SHA256 Credential=AKIAABCDEFGHIJKLMNOP/20261130/us-east-1/"
            f"sagemaker/aws4_request; x-amz-security-token:IQoJb3JpZ2luX2VjEJr; 'X-Amz-Security-Token': "
            f"b'FwoGZXIvYXdzEJr'; token ya29.a0AfH6SMBxyz123; client_secret=s3cr3t-value; "
            f"https://acct.blob.core.windows.net/c/f?sv=2021-08-06&sig=abc%2Bdef&se=2026; "
            f"key -----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBg\\n-----END PRIVATE KEY----- end")
    assert redact(text) == (
        "Authorization: Bearer [redacted]; AWS4-HMAC-SHA256 Credential=[redacted]/20261130/us-east-1/"
        "sagemaker/aws4_request; x-amz-security-token:[redacted]; 'X-Amz-Security-Token': b'[redacted]'; "
        "token [redacted]; client_secret=[redacted]; "
        "https://acct.blob.core.windows.net/c/f?sv=2021-08-06&sig=[redacted]&se=2026; key [redacted] end")
    # Ordinary text is left alone.
    plain = "Vertex AI 403 Forbidden: grant the worker's identity the Vertex AI User role (service_account)."
    assert redact(plain) == plain


def test_registered_values_are_redacted_with_the_secret_fields_of_a_key_file():
    secret = "PLANTED-" + uuid.uuid4().hex
    pem_line = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" + uuid.uuid4().hex
    key_file = json.dumps({"type": "service_account", "client_email": "tb@my-proj.iam.gserviceaccount.com",
                           "private_key_id": "kid-" + uuid.uuid4().hex,
                           "private_key": f"-----BEGIN PRIVATE KEY-----\n{pem_line}\n-----END PRIVATE KEY-----\n"})
    register({"client_secret": secret, "service_account_json": key_file, "region": "eu"})
    kid = json.loads(key_file)["private_key_id"]
    assert redact(f"refused {secret}!") == f"refused {REDACTED}!"
    assert redact(f"line {pem_line} / {kid}") == f"line {REDACTED} / {REDACTED}"
    assert redact("-----BEGIN PRIVATE KEY-----") == REDACTED  # the shape, not a registered armour line
    assert redact("-----END PRIVATE KEY-----") == "-----END PRIVATE KEY-----"
    # Not secret: the key file's type and e-mail, and short values.
    assert redact("service_account tb@my-proj.iam.gserviceaccount.com eu") == (
        "service_account tb@my-proj.iam.gserviceaccount.com eu")


def test_adapter_errors_and_log_records_carry_no_credentials(caplog):
    secret = "PLANTED-" + uuid.uuid4().hex
    register([secret])
    assert str(CredentialsError(f"denied for {secret}")) == f"denied for {REDACTED}"
    error = ProviderError("echo: Bearer ya29.abcdefghijkl", transient=True)
    assert str(error) == "echo: Bearer [redacted]" and error.transient

    caplog.set_level(logging.DEBUG)
    log = logging.getLogger("tests.redaction")
    log.info("sent %s with %s", "x-amz-security-token:IQoJb3JpZ2luX2VjEJr", secret)
    try:
        raise RuntimeError(f"provider said: {secret}")
    except RuntimeError:
        log.exception("call failed")
    messages = [r.getMessage() for r in caplog.records if r.name == "tests.redaction"]
    assert messages == [f"sent x-amz-security-token:{REDACTED} with {REDACTED}", "call failed"]
    assert secret not in caplog.text and f"RuntimeError: provider said: {REDACTED}" in caplog.text
