"""The document processing of the local task configs in this folder: each record is read by
lab/tasks.py's own reader of its format, the one eval.py --task uses, and handed to the
harness as the fields its prompt lines read. So the harness scores the strings eval.py --task scores
(the harness's own HellaSwag and WinoGrande prompts, as lab/tasks.py writes them), and a row
eval.py refuses is refused here too; tests/test_harness.py checks it, example by example. AI2's
nested ARC records become the fields of the harness's ARC copy (question, choices.text,
choices.label, answerKey)."""

from lab import tasks


def process_hellaswag(dataset):
    """{"ctx_a", "ctx_b", "activity_label", "endings", "label"} -> {"query", "choices", "gold"}."""
    def fields(doc):
        example = tasks.hellaswag_example("a hellaswag row", doc)
        context = example.pairs[0][0]
        endings = [continuation[1:] for _, continuation in example.pairs]  # without the " "
        return {"query": context, "choices": endings, "gold": example.label}

    return dataset.map(fields)


def winogrande_example(doc):
    return tasks.winogrande_example("a winogrande row", doc)


def winogrande_doc_to_text(doc):
    """Partial evaluation, as the harness does it: the "text" is the index of the right context."""
    return winogrande_example(doc).label


def winogrande_doc_to_target(doc):
    """The rest of the sentence after the blank (the harness puts the space in front of it)."""
    return winogrande_example(doc).pairs[0][1].lstrip()


def winogrande_doc_to_choice(doc):
    """The sentence up to the blank, with each option in it."""
    return [context for context, _ in winogrande_example(doc).pairs]


def process_arc(dataset):
    """AI2's {"question": {"stem", "choices": [{"text", "label"}]}, "answerKey"} -> the harness's
    {"question", "choices": {"text", "label"}, "answerKey"}; labels and key as strings."""
    def flatten(doc):
        choices = doc["question"]["choices"]
        if isinstance(choices, dict):  # datasets < 4 hands a list of records over as lists
            texts, labels = choices["text"], choices["label"]
        else:
            texts, labels = [c["text"] for c in choices], [c["label"] for c in choices]
        return {"id": doc.get("id"), "question": doc["question"]["stem"],
                "choices": {"text": texts, "label": [str(label) for label in labels]},
                "answerKey": str(doc["answerKey"])}

    return dataset.map(flatten, remove_columns=dataset.column_names)
