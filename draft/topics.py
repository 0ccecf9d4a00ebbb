"""Everyday encyclopedic topics for training prompts, the kind people ask a
chat model about. Any topic that shares a word with a benchmark topic
(bench/prompts.py) is dropped by `curated_topics`, so the benchmark prompts
stay held out."""

from __future__ import annotations

TOPICS = """
the solar system; the planet Mars; Jupiter; Saturn's rings; comets; meteors; the Milky Way;
galaxies; the Big Bang; gravity; magnetism; light; sound waves; the speed of light;
atoms; molecules; chemical reactions; acids and bases; the periodic table; metals;
plastics; glass; steam power; nuclear power; solar panels; wind turbines; batteries;
magnets; lightning; thunderstorms; hurricanes; tornadoes; snow; glaciers; deserts;
rainforests; coral reefs; mountains; rivers; lakes; islands; caves; the Amazon river;
the Sahara desert; the Himalayas; the Alps; the Nile; the Pacific; Antarctica; the Arctic;
wolves; elephants; lions; tigers; dolphins; whales; sharks; octopuses; penguins; owls;
eagles; parrots; butterflies; ants; spiders; frogs; snakes; turtles; horses; dogs; cats;
rabbits; dinosaurs; fossils; evolution; genetics; cells; bacteria; viruses; fungi;
trees; flowers; seeds; forests; soil; farming; wheat; rice; potatoes; tomatoes; apples;
bananas; chocolate; tea; bread; cheese; pizza; sushi; pasta; cooking; baking; nutrition;
vitamins; sleep; exercise; running; swimming; yoga; meditation; the brain; the lungs;
the skeleton; muscles; blood; the eyes; teeth; digestion; the common cold; allergies;
first aid; hospitals; nurses; doctors; medicine; antibiotics; surgery; mental health;
stress; happiness; friendship; kindness; honesty; patience; curiosity; creativity;
leadership; teamwork; time management; public speaking; writing essays; reading books;
libraries; poetry; novels; Shakespeare; fairy tales; mythology; Greek myths; the Vikings;
the Middle Ages; castles; knights; pirates; the Renaissance; Leonardo da Vinci;
the Industrial Revolution; the Aztecs; the Incas; the Silk Road; the Titanic;
World War One; World War Two; the Cold War; the United Nations; the European Union;
elections; voting; laws; courts; human rights; taxes; money; banks; inflation; budgeting;
saving money; credit cards; small businesses; marketing; advertising; trade; jobs;
interviews; resumes; computers; smartphones; software; programming; Python;
algorithms; databases; video games; robots; artificial intelligence; cybersecurity;
passwords; email; social media; websites; cloud computing; 3D printing; drones;
satellites; rockets; space travel; astronauts; the International Space Station;
telescopes; microscopes; cameras; photography; painting; drawing; sculpture; museums;
architecture; bridges; skyscrapers; roads; trains; airplanes; bicycles; ships;
submarines; traffic; cities; villages; maps; compasses; weather forecasts; seasons;
winter; summer; autumn; spring; holidays; birthdays; weddings; festivals; Halloween;
Thanksgiving; New Year; football; basketball; tennis; baseball; cricket; soccer;
the Tour de France; marathons; camping; hiking; fishing; gardening; houseplants;
knitting; origami; board games; puzzles; magic tricks; guitar; violin; drums; singing;
opera; rock and roll; hip hop; classical composers; Mozart; Beethoven; movies; cartoons;
theater; dance; ballet; fashion; clothing; shoes; colors; shapes; numbers; fractions;
geometry; algebra; statistics; probability; prime numbers; infinity; calendars; clocks;
languages; grammar; learning a new language; Spanish; Japanese; the alphabet;
handwriting; sign language; schools; homework; exams; universities; teachers;
scientists; inventors; Albert Einstein; Isaac Newton; Marie Curie; Charles Darwin;
Thomas Edison; the telephone; the light bulb; the wheel; paper; maps of the world;
pollution; plastic waste; deforestation; endangered species; national parks; zoos;
pets; veterinarians; firefighters; police officers; pilots; chefs; farmers; engineers;
architects; journalists; newspapers; television; radio; podcasts; blogging;
friendship at school; moving to a new city; learning to drive; buying a house;
renting an apartment; cleaning the house; cooking dinner; planning a trip; packing a suitcase;
airports; hotels; tourism; Paris; London; Tokyo; New York; Rome; India; Brazil; Canada;
Australia; Mexico; Africa; Europe; South America; deserts at night; the northern lights;
eclipses; the seasons of the year; tsunamis; floods; droughts; wildfires; air quality;
clean water; sanitation; vaccines for pets; bird migration; animal hibernation;
the food chain; ecosystems; biodiversity; oxygen; carbon dioxide; the atmosphere;
the ozone layer; gold; diamonds; salt; sugar; coal; oil and gas; electric cars;
public transport; cryptocurrency; online shopping; privacy; robots in factories;
""".replace("\n", " ")


LITTLE_WORDS = {"the", "and", "how", "for", "work", "what", "with"}


def curated_topics(held_out: set[str]) -> list[str]:
    """The topics above, less any sharing a word (3+ letters, singular or
    plural, other than little words like "the") with `held_out`."""
    def stems(words) -> set[str]:
        words = [w.lower().removesuffix("'s") for w in words]
        return {w.removesuffix("s") for w in words if len(w) >= 3} - LITTLE_WORDS

    banned = stems(held_out)
    topics = [t.strip() for t in TOPICS.split(";") if t.strip()]
    return [t for t in topics if not stems(t.split()) & banned]
