"""What `self_instruct` asks the target for: topic seeds (`TOPICS`) and
question styles (`STYLES`: the instruction, the answer begun for the target,
the question's possible first words)."""

from __future__ import annotations

from typing import NamedTuple

# Topic seeds: short phrases over what people ask a chat assistant about.
TOPICS = (
    # everyday life and home
    "morning routines", "cleaning a small apartment", "moving to a new city",
    "caring for houseplants", "organizing a closet", "doing laundry",
    "fixing a leaking faucet", "painting a bedroom", "choosing a mattress",
    "living with roommates", "adopting a dog", "training a puppy", "caring for a cat",
    "planning a birthday party", "buying a used car", "reducing screen time",
    "decluttering", "grocery shopping on a budget", "composting at home",
    "keeping a journal",
    # food and cooking
    "baking bread", "cooking pasta", "making soup", "vegetarian meals",
    "meal prepping for the week", "knife skills", "spices", "grilling vegetables",
    "fermenting vegetables", "making coffee at home", "brewing tea",
    "baking cookies", "food safety", "cooking rice", "breakfast ideas",
    # writing and language
    "writing a cover letter", "writing a short story", "writing a poem",
    "writing a persuasive essay", "email etiquette", "grammar rules",
    "learning Spanish", "learning Japanese", "idioms", "public speaking",
    "writing a speech for a wedding", "editing a draft", "writing dialogue",
    "naming a character", "writing a product description", "book reviews",
    "writing a thank-you note", "summarizing an article", "punctuation",
    # science
    "photosynthesis", "black holes", "the water cycle", "volcanoes",
    "earthquakes", "DNA", "vaccines", "the immune system", "climate change",
    "renewable energy", "electric circuits", "magnets", "the periodic table",
    "chemical reactions", "the solar system", "the moon", "gravity",
    "evolution", "bacteria and viruses", "ocean currents", "weather forecasts",
    "rainbows", "sound waves", "the speed of light", "quantum computing",
    "the human brain", "sleep science", "dinosaurs", "bees", "coral reefs",
    # history
    "the Roman Empire", "ancient Egypt", "the French Revolution",
    "the Industrial Revolution", "the printing press", "the Silk Road",
    "the Renaissance", "the Cold War", "the moon landing", "medieval castles",
    "the history of the internet", "ancient Greece", "the Vikings",
    "the invention of the telephone", "the history of money",
    "world war one", "the abolition of slavery", "the history of medicine",
    "explorers of the fifteenth century", "the history of chess",
    # coding and technology
    "Python lists", "Python dictionaries", "recursion", "sorting algorithms",
    "binary search", "Git branches", "unit testing", "SQL joins",
    "regular expressions", "JavaScript promises", "CSS layouts", "HTML forms",
    "REST APIs", "debugging a program", "object-oriented programming",
    "linked lists", "hash tables", "Linux command line", "Docker containers",
    "writing clean code", "learning to program", "password security",
    "backing up files", "choosing a laptop", "spreadsheets", "machine learning",
    "neural networks", "cloud storage", "home Wi-Fi", "smartphone batteries",
    # business and work
    "starting a small business", "writing a business plan", "marketing on social media",
    "job interviews", "asking for a raise", "remote work", "time management",
    "running a meeting", "giving feedback to a colleague", "negotiating a salary",
    "customer service", "pricing a product", "freelancing", "writing a resume",
    "leading a team", "managing stress at work", "networking events",
    "career changes", "project deadlines", "opening a cafe",
    # money
    "saving money", "making a budget", "paying off debt", "credit scores",
    "investing for beginners", "retirement savings", "renting versus buying a home",
    "taxes for freelancers", "emergency funds", "comparing phone plans",
    # health and fitness
    "running a first 5k", "strength training", "stretching", "healthy snacks",
    "drinking enough water", "better sleep", "back pain from sitting",
    "meditation", "managing anxiety", "yoga for beginners", "cycling to work",
    "eating more vegetables", "walking every day", "posture",
    "first aid for minor cuts", "seasonal allergies", "swimming lessons",
    # travel and geography
    "a trip to Japan", "a weekend in Paris", "packing light", "traveling on a budget",
    "long flights", "jet lag", "camping in the mountains", "road trips",
    "visiting national parks", "learning local customs", "travel insurance",
    "train travel in Europe", "hiking safety", "the Amazon rainforest",
    "deserts", "island vacations", "traveling with children", "the Alps",
    "backpacking in South America", "visiting museums abroad",
    # arts, culture and hobbies
    "learning the guitar", "piano practice", "jazz", "classical music",
    "film history", "photography", "drawing portraits", "watercolor painting",
    "knitting", "pottery", "board games", "chess openings", "gardening",
    "birdwatching", "writing song lyrics", "modern architecture",
    "famous paintings", "science fiction novels", "mystery novels", "poetry forms",
    "stand-up comedy", "video game design", "podcasting", "origami",
    # sports
    "soccer rules", "basketball drills", "tennis serves", "the Olympic Games",
    "marathon training", "rock climbing", "skiing", "team sports for kids",
    # nature and environment
    "recycling", "endangered species", "bird migration", "rivers", "forests",
    "plastic pollution", "solar panels", "saving water", "wild mushrooms",
    "urban gardens",
    # society, ethics and civics
    "how elections work", "freedom of speech", "privacy online", "fake news",
    "volunteering", "the ethics of artificial intelligence", "the trolley problem",
    "free will", "happiness", "stoic philosophy", "the meaning of fairness",
    "how laws are made", "jury duty", "renting an apartment legally",
    "consumer rights", "copyright", "city planning", "public transport",
    # relationships and people
    "making new friends", "resolving an argument", "long-distance relationships",
    "raising teenagers", "talking to a shy child", "being a good listener",
    "apologizing", "setting boundaries", "supporting a grieving friend",
    "planning a family reunion",
    # learning and school
    "studying for exams", "taking good notes", "learning faster", "homework help",
    "choosing a university", "writing a research paper", "teaching a class",
    "online courses", "memorizing vocabulary", "motivation to study",
    # math and reasoning
    "fractions", "percentages", "probability", "prime numbers", "geometry",
    "algebra word problems", "statistics", "logic puzzles", "riddles",
    "estimating quantities", "compound interest", "unit conversions",
    "the Monty Hall problem", "patterns in numbers", "making decisions with data",
    # roleplay personas
    "a ship's captain", "a medieval knight", "a museum tour guide",
    "a detective", "a personal trainer", "a travel agent", "a chef",
    "a history teacher", "a job interviewer", "a tech support agent",
    "a space explorer", "a wise old wizard", "a career coach",
    "a librarian", "a park ranger",
)


class Style(NamedTuple):
  instruction: str      # the user turn: "{topic}" filled in
  lead: str             # the answer begun for the target (ends inside a quote)
  openers: tuple        # the question's first words, one per candidate


_REQUEST = "Here is such a request:\n\n\""
STYLES = {
    "ask": Style("Write one question a user might ask an AI assistant about {topic}.",
                 "Here is a question a user might ask about {topic}:\n\n\"",
                 ("How", "What", "Why", "Which", "What is the best way to", "Should I",
                  "Is it true that", "When")),
    "explain": Style("Write one request a user might send an AI assistant, asking it to "
                     "explain something about {topic}.", _REQUEST,
                     ("Can you explain", "Explain", "Could you explain how",
                      "Please explain why")),
    "write": Style("Write one request a user might send an AI assistant, asking it to "
                   "write something about {topic}.", _REQUEST,
                   ("Write a", "Write a short", "Draft a", "Compose a")),
    "compare": Style("Write one request a user might send an AI assistant, asking it to "
                     "compare two things about {topic}.", _REQUEST,
                     ("Compare", "What are the differences between", "Which is better,")),
    "plan": Style("Write one request a user might send an AI assistant, asking for help "
                  "to plan something about {topic}.", _REQUEST,
                  ("Help me plan", "Make a plan", "Create a schedule", "Can you help me")),
    "advise": Style("Write one request a user might send an AI assistant, asking for "
                    "advice about {topic}.", _REQUEST,
                    ("I want to", "I'm trying to", "Give me tips", "What should I do")),
    "list": Style("Write one request a user might send an AI assistant, asking for a "
                  "list about {topic}.", _REQUEST,
                  ("List", "Give me five", "What are some")),
    "roleplay": Style("Write one request a user might send an AI assistant, asking it to "
                      "play a role related to {topic}.", _REQUEST,
                      ("Pretend you are", "Act as", "Imagine you are")),
    "reason": Style("Write one question about {topic} that needs careful step-by-step "
                    "reasoning.", "Here is such a question:\n\n\"",
                    ("If", "Suppose", "Why does", "How many")),
}
