"""LongBench's official prompt of each dataset (``config/dataset2prompt.json``), ``{context}`` and ``{input}`` filled
by the task."""

_QA = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
_MULTI_DOC = f"{_QA}\n\nThe following are given passages.\n{{context}}\n\n{_QA}\n\nQuestion: {{input}}\nAnswer:"
_NARRATIVE = "asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
_QASPER = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
    'answered based on the information in the article, write "unanswerable". If the question is a yes/no '
    'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)

# The official prompt templates (config/dataset2prompt.json). The narrativeqa template says
# "asconcisely" (sic) twice, as in the configuration used by LongBench and the KV-cache papers.
PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. "
        f"Answer the question {_NARRATIVE}\n\nStory: {{context}}\n\n"
        f"Now, answer the question based on the story {_NARRATIVE}\n\nQuestion: {{input}}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. Answer the question {_QASPER}\n\n"
        f"Article: {{context}}\n\n Answer the question based on the above article {_QASPER}\n\n"
        "Question: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\n"
        "Now, answer the following question based on the above text, only give me the answer and do not "
        "output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _MULTI_DOC,
    "2wikimqa": _MULTI_DOC,
    "musique": _MULTI_DOC,
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. "
        "Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
        "Query: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be like "
        '"Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: '
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n"
        '下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
